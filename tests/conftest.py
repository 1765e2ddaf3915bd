import os
import sys

# The spawned ranks import the helper modules next to the tests by name.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
