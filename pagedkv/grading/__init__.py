"""The graded-exercise pipeline, built on otter-grader (see grading/README.md).

- :mod:`pagedkv.grading.build`: ``grading/source/NN_name.ipynb`` -> ``exercises/``, ``solutions/`` and
  ``grading/autograder/NN_name.zip`` (``pagedkv build-exercises``), reproducibly.
- :mod:`pagedkv.grading.grade`: grade notebooks on copies, with time limits (``pagedkv grade``).
- :mod:`pagedkv.grading.worker`: one notebook, graded in a trusted process of its own: the hidden tests run
  there, with names for the learner's functions and classes (:mod:`~pagedkv.grading.client`); only plain data
  crosses (:mod:`~pagedkv.grading.plain`: JSON, never pickle) to the sandbox that runs the learner's code
  (:mod:`~pagedkv.grading.sandbox`, :mod:`~pagedkv.grading.sandbox_main`), one per exercise.
- :mod:`pagedkv.grading.progress`: ``.pagedkv/progress.json``, :func:`progress_table`, :func:`grade_notebook_here`.
- :mod:`pagedkv.grading.classroom`: ``pagedkv grade --class FOLDER --csv FILE``.
- :mod:`pagedkv.grading.checks`: what exercise tests use to call the learner's code and word failures.
"""


def progress_table(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - see pagedkv.grading.progress
    """The per-set summary of the last grades (see :func:`pagedkv.grading.progress.progress_table`)."""
    from pagedkv.grading.progress import progress_table as table

    return table(*args, **kwargs)


def grade_notebook_here(path=None, **kwargs):  # noqa: ANN001, ANN003, ANN201 - see pagedkv.grading.progress
    """Grade the notebook this is called from (see :func:`pagedkv.grading.progress.grade_notebook_here`)."""
    from pagedkv.grading.progress import grade_notebook_here as here

    return here(path, **kwargs)
