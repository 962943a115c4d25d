from __future__ import annotations

import sys
from pathlib import Path

# Helpers in tests/ (dlock_support) import as top-level modules from any test directory.
sys.path.insert(0, str(Path(__file__).parent))
