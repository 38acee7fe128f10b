"""An untrained EAGLE-3 head for the 1.5B target, as `distill --kind eagle` starts one (its layer
from the target's last, fc passing the highest state), drafting the target's first 32000 ids:
to see vLLM load and run the tuner's eagle3 candidate, not to measure a head."""
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specdecode.distill.eagle import new_head, training_layers
from specdecode.models.eagle_head import write_head

folder = Path.home() / ".cache/specdecode/qwen2.5-coder-1.5b-instruct"
target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
aux = training_layers(target.config.num_hidden_layers)
head = new_head(target, aux, torch.arange(32000), str(folder))
write_head(Path(sys.argv[1]), head, str(folder), {"note": "untrained: the initial head only"})
print("written", sys.argv[1], aux)
