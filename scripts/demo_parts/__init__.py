"""The parts of ``scripts/demo.py``, one module per plugin, each run in its plugin's venv as
``python -m demo_parts.<part> [--model DIR]`` (``common`` holds what they share)."""
