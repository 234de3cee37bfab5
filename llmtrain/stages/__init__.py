"""The training stages. `registry.py` finds each by name; `spec.py` says what a stage declares."""
