"""Training: the loop (trainer.py), data, models, synchronised BatchNorm and test fixtures."""
