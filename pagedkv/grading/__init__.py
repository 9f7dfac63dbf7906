"""The graded-exercise pipeline, built on otter-grader (see grading/README.md).

- :mod:`pagedkv.grading.build`: ``grading/source/NN_name.ipynb`` -> ``exercises/``, ``solutions/`` and
  ``grading/autograder/NN_name.zip`` (``pagedkv build-exercises``), reproducibly.
- :mod:`pagedkv.grading.grade`: grade notebooks on copies, with time limits (``pagedkv grade``).
- :mod:`pagedkv.grading.worker`: one notebook's ``otter run``, in a process of its own.
- :mod:`pagedkv.grading.checks`: what exercise tests use to call the learner's code and word failures.
"""
