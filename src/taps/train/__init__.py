"""Training the EAGLE head on teacher-forced target features (docs/spec.md §1 and §6).

`losses` defines the batch format and the EAGLE-2 and HASS objectives; the training loop that
calls them and steps the optimizer (once per batch) lives beside it.
"""
