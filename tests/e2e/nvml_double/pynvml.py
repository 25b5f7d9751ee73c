"""pynvml for a node agent under test: NVIDIA's module, every NVML call of it answered by the NVML double
(tests/nvmldouble.py) whose memory the folder named by NVML_DOUBLE sets. tests/e2e/test_node_page.py puts this folder
first on one agent's PYTHONPATH, so that process alone imports it in the place of NVIDIA's."""
import importlib
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
# NVIDIA's module is the next pynvml on the path; imported from here, it takes this one's place in sys.modules, and
# the import that found this file hands that one to its caller.
del sys.modules[__name__]
_path = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
try:
    _nvidia = importlib.import_module("pynvml")
finally:
    sys.path[:] = _path

from tests import nvmldouble  # after NVIDIA's module is in place: the double takes its errors from it

nvmldouble.install(_nvidia, nvmldouble.agent_double(os.environ["NVML_DOUBLE"]))
