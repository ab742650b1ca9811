"""Loaded at start-up by a child process whose PYTHONPATH starts here (``tests.pause_points.child_env``):
pauses the process at the stage ``QUANTSHIP_TEST_PAUSE_AT`` names, so the test can kill it there."""

import os
import sys

_stage = os.environ.get("QUANTSHIP_TEST_PAUSE_AT")
if _stage:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.pause_points import install, pause

    install(lambda stage: pause(stage) if stage == _stage else None)
