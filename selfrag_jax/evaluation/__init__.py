"""Evaluation: the released metrics (`eval`) and re-ranking sweeps over a `--cache` (`sweep`)."""
