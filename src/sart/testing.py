"""Test helpers that are public API: fakes and conformance checks.

Use them to test your own policies (``FakeEngine`` + ``ScriptedPRM``) and your
own engine adapters (``check_engine``), as ``trio.testing`` does for trio.
"""

from sart.engines.conformance import check_engine
from sart.engines.fake import FakeEngine
from sart.engines.fake_streaming import FakeStreamingEngine
from sart.engines.scripts import BranchScript, ScriptTable, random_scripts
from sart.errors import EngineMisuse
from sart.prm.scripted import ScriptedPRM

__all__ = [
    "BranchScript",
    "EngineMisuse",
    "FakeEngine",
    "FakeStreamingEngine",
    "ScriptTable",
    "ScriptedPRM",
    "check_engine",
    "random_scripts",
]
