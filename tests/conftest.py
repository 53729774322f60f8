import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))  # examples/gpt.py is the models' home
os.environ.setdefault("OMP_NUM_THREADS", "1")
