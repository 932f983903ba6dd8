"""Research-check experiments: does the RLT learn what it is claimed to learn?

* :mod:`rlt_scale.experiments.evaluate` - final-state accuracy of any predictor on a prepared task set;
* :mod:`rlt_scale.experiments.baselines` - the parameter-matched causal Transformer and GRU, and their
  training loop (same data, optimizer, schedule and early stopping as the RLT's ``Trainer``);
* :mod:`rlt_scale.experiments.supervision` - training targets: the final answer, or the running state too;
* :mod:`rlt_scale.experiments.curriculum` - one model's training, in one stage or through a length curriculum;
* :mod:`rlt_scale.experiments.state_tracking` - the whole table (``python -m rlt_scale.experiments.state_tracking``):
  data, the learning-rate sweep chosen on validation sets, the test runs;
* :mod:`rlt_scale.experiments.report` - the markdown tables and the accuracy-vs-length plots.

Results and the exact commands: ``docs/RESULTS.md``.
"""
