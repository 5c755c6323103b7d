import os
import sys

# The scenario suite lives in bench/ at the repository root.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
