"""Experiment: do intermediate-layer features help path heads? (scratch, not project code)

Two path heads (cross-entropy, 3 epochs) on 800 of the larger recipe's answers (shuffled with seed
0; 720 to train, 80 held out), with and without the backbone's layers 10 and 20 as extra input.
Needs runs/smollm2-135m-large/data (``python train_heads.py --config recipes/smollm2-135m-large.yaml``):

    python docs/path-heads/layers_experiment.py 800 10,20 3      # layers_experiment.log
"""
import sys, time, json
import torch
from torch import nn
from torch.nn import functional as F
from datasets import load_from_disk
from medusa_infer.model import MedusaModel
from medusa_train.features import pad_batch, head_targets
from medusa_train.losses import IGNORE

torch.manual_seed(0)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 800
LAYERS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [10, 20]
EPOCHS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
K = 2
ds = load_from_disk(sys.argv[4] if len(sys.argv) > 4 else
                    "runs/smollm2-135m-large/data/tokenized-0e4dcdde7f0a1a4328c10378")
ds = ds.shuffle(seed=0).select(range(N))
model = MedusaModel.without_heads("smollm2-135m-instruct").eval()
base = model.base_model
emb = base.get_input_embeddings().weight.detach()
W = model.lm_head.weight.detach()
norm = base.model.norm
rows = {"last": [], "mid": [], "next": [], "tgt": [], "ex": []}
t0 = time.time()
with torch.inference_mode():
    for i in range(0, N, 8):
        ex = [ds[j] for j in range(i, min(i + 8, N))]
        b = pad_batch(ex)
        out = base(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_hidden_states=True)
        hs = out.hidden_states
        last = norm(hs[-1])
        mids = torch.cat([norm(hs[l]) for l in LAYERS], -1)
        labels = b["labels"]
        tg = head_targets(labels, K + 1)  # [B, L, K+1]: t+2.. ; path token t+2 = tg[...,0]
        ok = tg[..., 0] != IGNORE
        nxt = torch.cat([b["input_ids"][:, 1:], b["input_ids"][:, -1:]], 1)
        rows["last"].append(last[ok]); rows["mid"].append(mids[ok]); rows["next"].append(nxt[ok])
        rows["tgt"].append(tg[ok]); rows["ex"].append(torch.full((int(ok.sum()),), i))
print("features", time.time() - t0, flush=True)
R = {k: torch.cat(v) for k, v in rows.items()}
held = R["ex"] >= int(N * 0.9) // 8 * 8
V = 4096
counts = torch.bincount(R["tgt"][~held][..., 0].clamp(min=0).flatten(), minlength=W.shape[0])
tmap = counts.argsort(descending=True)[:V]
inv = torch.full((W.shape[0],), -1); inv[tmap] = torch.arange(V)
H = W.shape[1]


class Head(nn.Module):
    def __init__(self, k, mid):
        super().__init__()
        self.tok = nn.Linear(H, H, bias=False); nn.init.zeros_(self.tok.weight)
        self.path = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(k))
        for p in self.path: nn.init.zeros_(p.weight)
        self.mid = nn.Linear(H * len(LAYERS), H, bias=False) if mid else None
        if mid: nn.init.zeros_(self.mid.weight)
        self.lin = nn.Linear(H, H); nn.init.zeros_(self.lin.weight); nn.init.zeros_(self.lin.bias)
        self.proj = nn.Linear(H, V, bias=False)
        with torch.no_grad(): self.proj.weight.copy_(W[tmap])

    def forward(self, last, mid, nxt, path):
        x = last + self.tok(emb[nxt])
        for j, p in enumerate(self.path): x = x + p(emb[path[:, j]])
        if self.mid is not None: x = x + self.mid(mid)
        x = x + F.silu(self.lin(x))
        return self.proj(x)


def run(mid):
    torch.manual_seed(0)
    heads = nn.ModuleList(Head(k, mid) for k in range(K))
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3, weight_decay=0.0)
    tr = (~held).nonzero().squeeze(1)
    steps = EPOCHS * (len(tr) // 1024)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 3e-3, total_steps=steps, pct_start=0.05)
    s = 0
    for ep in range(EPOCHS):
        perm = tr[torch.randperm(len(tr))]
        for i in range(0, len(perm) - 1023, 1024):
            idx = perm[i:i + 1024]
            path = R["tgt"][idx][:, :K].clamp(min=0)
            loss = 0
            for k, h in enumerate(heads):
                t = inv[R["tgt"][idx][:, k].clamp(min=0)]
                t[(R["tgt"][idx][:, k] == IGNORE) | (t < 0)] = -100
                loss = loss + 0.8 ** k * F.cross_entropy(h(R["last"][idx], R["mid"][idx], R["next"][idx], path), t,
                                                        ignore_index=-100)
            opt.zero_grad(); loss.backward(); opt.step(); sched.step(); s += 1
    with torch.no_grad():
        idx = held.nonzero().squeeze(1)
        path = R["tgt"][idx][:, :K].clamp(min=0)
        acc = []
        for k, h in enumerate(heads):
            pred = tmap[h(R["last"][idx], R["mid"][idx], R["next"][idx], path).argmax(-1)]
            tt = R["tgt"][idx][:, k]
            m = tt != IGNORE
            acc.append(round(float((pred[m] == tt[m]).float().mean()), 4))
    return acc


t0 = time.time()
print("last only", run(False), time.time() - t0, flush=True)
t0 = time.time()
print("with layers", LAYERS, run(True), time.time() - t0, flush=True)
