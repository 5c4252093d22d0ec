"""Scripts run from the checkout (`python tools/NAME.py`), never installed; tests import
them as `tools.NAME`."""
