"""Each lesson's exercise checks, one module per exercise set, beside the grading machinery.

The test cells of ``grading/source/NN_name.ipynb`` import their checks from here (``lNN_name``), so that the
library's packages (``pagedkv.kernels``, ``pagedkv.sim``, ...) hold only what the lessons teach. A module here
may import the library (the reference answers, harness kernels, the simulator) to judge the learner's code;
the library never imports these modules. Importing this package imports none of them (set 06's pulls in
Triton).
"""
