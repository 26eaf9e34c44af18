"""The training loop: engine, build (feature wiring), LR schedules."""
