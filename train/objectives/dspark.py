"""DSpark's training part (models/dspark.py): DFlash's builder and objective (train/objectives/dflash.py) over a DSpark
drafter, whose two hooks make the objective DSpark's, as speculators 0.9.0's DSpark trainer defines it
(speculators/models/dspark: ``DSparkDraftModel.forward``, ``compute_metrics``):

- the anchor drafts (``sample_from_anchor``): each of up to ``num_anchors`` anchors a per packed row opens a block of
  ``block_size`` = B tokens, and slot j (0..B-1) is scored on the token at a + 1 + j, against the target's
  distribution at a + j, weighted ``exp(-j / gamma)`` (speculators' ``dflash_loss_decay`` with
  ``sample_from_anchor``: slot 0 weighs 1; ``drafter.position_decay``, speculators' gamma 4 in
  conf/drafter/dspark.yaml);
- slot j's logits carry the Markov bias of the data's token at a + j (teacher forcing: speculators'
  ``prev_token_ids = block_tokens``), so the Markov head learns with the backbone, through one matmul
  (``head_input`` = [state, markov_w1[prev]] against ``head_weight`` = [lm_head, markov_w2]).

The formula is the registered ``drafter.loss`` (soft CE by default: KL to the target's distribution, speculators'
default, up to the target's entropy, which has no gradient). Not trained: speculators' confidence head (vLLM reads it
only for adaptive verification).
"""

from fledge.train.objectives.base import OBJECTIVES
from fledge.train.objectives.dflash import build

OBJECTIVES.register("dspark", build)
