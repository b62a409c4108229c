"""Each drafter algorithm's training part, one module per algorithm (models/algorithms.py names the algorithms):
the drafter built for training, its teacher head and its objective over the shared feature batch, registered in
``OBJECTIVES`` under the algorithm's name. train/ttt_model.py looks the run's up and wraps it into the module
DeepSpeed trains.

- eagle.py: EAGLE-3/3.1 and P-EAGLE: the drafter over the draft vocab, the registered loss unrolled over the TTT
  steps, and ``drafter.init_from``;
- dflash.py: DFlash: the drafter over the target's whole vocab and the block objective;
- mtp.py: the target's own MTP module (models/mtp_drafter.py), TTT over its chained drafts as vLLM chains them;
- dspark.py: DSpark: DFlash's builder and objective over a drafter whose anchor drafts, with a Markov head;
- base.py: the registry and what a builder returns (:class:`Trainable`, its :class:`Objective`).

A new algorithm adds one module here registering its builder (tests/unit/test_algorithms.py registers a toy one).
"""

from fledge.train.objectives import dflash, dspark, eagle, mtp  # noqa: F401 (each registers its algorithm)
from fledge.train.objectives.base import OBJECTIVES, Builder, Objective, Trainable

__all__ = ["OBJECTIVES", "Builder", "Objective", "Trainable"]
