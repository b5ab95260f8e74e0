"""Names the multiprocessing semaphores of every process a test starts with the test's own tag.

tests/test_exit.py (``tagged_env``) puts this folder first on ``PYTHONPATH`` and the tag in
``PL_TEST_SEMPREFIX``; Python imports ``sitecustomize`` at start-up, and children (spawned, forked
or from a fork server) inherit both, so each ``/dev/shm/sem.mp-*`` entry the test's process tree
makes is ``sem.mp-<tag>-...``. A shared machine's other programs make ``sem.mp-<random>`` entries
meanwhile: with the tag, a test counts only its own leftovers, and still every one of them.
"""

import os

if os.environ.get("PL_TEST_SEMPREFIX"):
    import multiprocessing.process

    multiprocessing.process.current_process()._config["semprefix"] = os.environ["PL_TEST_SEMPREFIX"]
