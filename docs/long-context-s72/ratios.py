"""The demo calibration's prices of a forward against one token's, by context (README, Long contexts).

    python docs/long-context-s72/ratios.py
"""

import json
from pathlib import Path

from medusa_infer.tree_fit import CostProfile

calibration = json.loads((Path(__file__).parent / "demo_calibration.json").read_text())
profile = CostProfile.from_dict(calibration["cost_profile"])
for context in (256, 1000, 1500, 2048):
    prices = (f"t({n})/t(1) {profile.ratio(n, context):.3f}" for n in (2, 5, 9, 11, 17))
    print(f"{context:5d} cached tokens:", "  ".join(prices))
