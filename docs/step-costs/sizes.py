import torch, time
from medusa_infer.model import MedusaModel
from medusa_infer.tree_fit import measure_verify_cost
torch.set_num_threads(2)
model = MedusaModel.from_pretrained("runs/demo/heads").eval()  # any heads: only the base model is timed
for rep in range(2):
    p = measure_verify_cost(model, sizes=list(range(1, 11)) + [12, 16], context=256, repeats=20)
    print(" ".join(f"{n}:{s/p.seconds[0]:.3f}" for n, s in zip(p.sizes, p.seconds)), f"t1={p.seconds[0]*1000:.1f}ms")
