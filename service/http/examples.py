"""The API description's examples: inputs of the demo layer, so that each one runs as written."""

from __future__ import annotations

import math

from ...weights.demo import DEMO_CONFIG

# Two tokens of the demo layer's hidden size; logits for its experts
DEMO_ROWS = [
    [round(0.1 * math.sin(row + 0.37 * col), 4) for col in range(DEMO_CONFIG.hidden_size)]
    for row in range(2)
]
DEMO_LOGITS = [[round(math.cos(e), 3) for e in range(DEMO_CONFIG.num_experts)]]
