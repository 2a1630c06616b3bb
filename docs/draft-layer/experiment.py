"""Scratch experiment (not project code): does attention over the context help the heads?

An EAGLE-style draft layer (token embedding and hidden state through ``fc``, one transformer block
with its own attention over the earlier positions, reused depth after depth on its own output
features, trained with cross-entropy plus a feature regression, "training-time test" masks) and a
Medusa head 0 with and without a zero-initialised attention sublayer, against the path heads of
docs/path-heads. Held-out top-1 per depth, with the true tokens before each prediction (teacher
forcing, as the heads' held-out figures). 800 of the larger recipe's answers, shuffled with seed
0, 720 to train and 80 held out (the split of docs/path-heads' layer experiment).

Needs runs/smollm2-135m-large/data (``python train_heads.py --config recipes/smollm2-135m-large.yaml``).
Arguments: answers, epochs, depths, regression weight, learning rate; ``ARCH`` = draft | head | headattn.

    python docs/draft-layer/experiment.py 800 3 3 1.0 1e-3                 # exp_eagle.log
    python docs/draft-layer/experiment.py 800 3 3 0.1 3e-3                 # exp_eagle2.log
    ARCH=head python docs/draft-layer/experiment.py 800 3 1 0.0 3e-3       # exp_head.log
    ARCH=headattn python docs/draft-layer/experiment.py 800 3 1 0.0 3e-3   # exp_headattn.log

The first run keeps the backbone's hidden states in /tmp/eagle_feats_800.pt (418 MB) for the others.
"""
import sys, time, math
import torch
from torch import nn
from torch.nn import functional as F
from datasets import load_from_disk
from medusa_infer.model import MedusaModel
from medusa_train.features import pad_batch
from medusa_train.losses import IGNORE

torch.manual_seed(0)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 800
EPOCHS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
D = int(sys.argv[3]) if len(sys.argv) > 3 else 3
REG = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
LR = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-3
import os
ds = load_from_disk("runs/smollm2-135m-large/data/tokenized-0e4dcdde7f0a1a4328c10378")
ds = ds.shuffle(seed=0).select(range(N))
model = MedusaModel.without_heads("smollm2-135m-instruct").eval()
base = model.base_model
emb = base.get_input_embeddings().weight.detach()
W = model.lm_head.weight.detach()
H = W.shape[1]
seqs = []
t0 = time.time()
CACHE = f"/tmp/eagle_feats_{N}.pt"
if os.path.exists(CACHE):
    seqs = torch.load(CACHE, weights_only=True)
else:
  with torch.inference_mode():
    for i in range(0, N, 8):
        ex = [ds[j] for j in range(i, min(i + 8, N))]
        b = pad_batch(ex)
        out = base(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_hidden_states=True)
        last = base.model.norm(out.hidden_states[-1])
        for r, e in enumerate(ex):
            n = len(e["input_ids"])
            seqs.append((last[r, :n].clone(), b["input_ids"][r, :n].clone(), b["labels"][r, :n].clone(), i))
  torch.save(seqs, CACHE)
print("features", round(time.time() - t0), "s", flush=True)
held_from = int(N * 0.9) // 8 * 8
train = [s for s in seqs if s[3] < held_from]
held = [s for s in seqs if s[3] >= held_from]
V = 4096
counts = torch.zeros(W.shape[0], dtype=torch.long)
for h, ids, lab, _ in train:
    counts += torch.bincount(lab[lab != IGNORE], minlength=W.shape[0])
tmap = counts.argsort(descending=True)[:V]
inv = torch.full((W.shape[0],), -1)
inv[tmap] = torch.arange(V)
NH, HD = 9, 64


def rope(x, pos):  # x [B, heads, L, hd], pos [L]
    half = HD // 2
    freq = 1.0 / (100000 ** (torch.arange(half) / half))
    ang = pos[:, None].float() * freq[None]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Draft(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2 * H, H, bias=False)
        with torch.no_grad():  # start as "hidden + 0": the identity on the hidden part
            self.fc.weight.zero_(); self.fc.weight[:, :H].copy_(torch.eye(H))
        self.n1 = nn.RMSNorm(H); self.n2 = nn.RMSNorm(H)
        self.q = nn.Linear(H, H, bias=False); self.k = nn.Linear(H, H, bias=False)
        self.v = nn.Linear(H, H, bias=False); self.o = nn.Linear(H, H, bias=False)
        self.g = nn.Linear(H, 1536, bias=False); self.u = nn.Linear(H, 1536, bias=False)
        self.d = nn.Linear(1536, H, bias=False)
        nn.init.zeros_(self.o.weight); nn.init.zeros_(self.d.weight)
        self.nout = nn.RMSNorm(H)
        self.proj = nn.Linear(H, V, bias=False)
        with torch.no_grad(): self.proj.weight.copy_(W[tmap])

    def entry(self, hid, tok):
        return self.fc(torch.cat([hid, emb[tok]], -1))

    def qkv(self, x, pos):
        B, L, _ = x.shape
        y = self.n1(x)
        q = rope(self.q(y).view(B, L, NH, HD).transpose(1, 2), pos)
        k = rope(self.k(y).view(B, L, NH, HD).transpose(1, 2), pos)
        v = self.v(y).view(B, L, NH, HD).transpose(1, 2)
        return q, k, v

    def finish(self, x, q, keys, values, mask):
        B, L, _ = x.shape
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(B, L, H))
        y = self.n2(x)
        return x + self.d(F.silu(self.g(y)) * self.u(y))

    def logits(self, f):
        return self.proj(self.nout(f))


class HeadAttn(nn.Module):
    """Medusa head 0 (next-token input, one ResBlock, own projection) plus, with attn, a
    zero-initialised attention sublayer over the earlier positions' head inputs."""
    def __init__(self, attn=True):
        super().__init__()
        self.attn = attn
        self.tok = nn.Linear(H, H, bias=False); nn.init.zeros_(self.tok.weight)
        self.n1 = nn.RMSNorm(H)
        self.q = nn.Linear(H, H, bias=False); self.k = nn.Linear(H, H, bias=False)
        self.v = nn.Linear(H, H, bias=False); self.o = nn.Linear(H, H, bias=False)
        nn.init.zeros_(self.o.weight)
        self.lin = nn.Linear(H, H); nn.init.zeros_(self.lin.weight); nn.init.zeros_(self.lin.bias)
        self.proj = nn.Linear(H, V, bias=False)
        with torch.no_grad(): self.proj.weight.copy_(W[tmap])

    def entry(self, hid, tok):
        return hid + self.tok(emb[tok])

    qkv = Draft.qkv

    def finish(self, x, q, keys, values, mask):
        if self.attn:
            B, L, _ = x.shape
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            x = x + self.o(a.transpose(1, 2).reshape(B, L, H))
        return x + F.silu(self.lin(x))

    def logits(self, f):
        return self.proj(f)


def batch_seqs(items):
    L = max(len(s[1]) for s in items)
    hid = torch.zeros(len(items), L, H); ids = torch.zeros(len(items), L, dtype=torch.long)
    lab = torch.full((len(items), L), IGNORE); valid = torch.zeros(len(items), L, dtype=torch.bool)
    for r, (h, i, l, _) in enumerate(items):
        n = len(i); hid[r, :n] = h; ids[r, :n] = i; lab[r, :n] = l; valid[r, :n] = True
    return hid, ids, lab, valid


def run_passes(model, hid, ids, valid):
    """Depth d (1..D) output at position t predicts token t + d + 1; inputs teacher-forced tokens,
    the draft's own features from depth 2 on."""
    B, L, _ = hid.shape
    pos = torch.arange(L)
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], 1)  # token t + 1
    keys, values, outs = [], [], []
    feat = hid
    for d in range(D):
        # depth d+1 entry at position p = t + d holds (feature of p, token p + 1); stored aligned at t
        tok = torch.cat([nxt[:, d:], nxt[:, -1:].expand(B, d)], 1) if d else nxt
        x = model.entry(feat, tok)
        q, k, v = model.qkv(x, pos + d)
        keys.append(k); values.append(v)
        # query at t (depth d+1, position t+d) sees: depth-1 keys at positions <= t, i.e. entries
        # t' <= t; depth j+1 keys (j >= 1) only at the same t (its own chain).
        m1 = torch.ones(L, L, dtype=torch.bool).tril()
        parts = [m1] + [torch.eye(L, dtype=torch.bool)] * d
        mask = torch.cat(parts, 1)[None, None] & torch.cat([valid] * (d + 1), 1)[:, None, None, :]
        f = model.finish(x, q, torch.cat(keys, 2), torch.cat(values, 2), mask)
        outs.append(f)
        feat = f
    return outs


def losses(model, items):
    hid, ids, lab, valid = batch_seqs(items)
    outs = run_passes(model, hid, ids, valid)
    L = hid.shape[1]
    total, stats = 0.0, []
    for d, f in enumerate(outs):
        tgt = torch.full_like(lab, IGNORE)
        tgt[:, : L - d - 2] = lab[:, d + 2:]
        m = tgt != IGNORE
        t = inv[tgt[m]]
        ce = F.cross_entropy(model.logits(f[m]), t, ignore_index=-1)
        fh = torch.zeros_like(hid); fh[:, : L - d - 1] = hid[:, d + 1:]
        reg = F.smooth_l1_loss(f[m], fh[m])
        total = total + 0.8 ** d * (ce + REG * reg)
        stats.append((float(ce.detach()), float(reg.detach())))
    return total, stats


def evaluate(model):
    right = [0] * D; n = [0] * D
    with torch.no_grad():
        for i in range(0, len(held), 8):
            items = held[i:i + 8]
            hid, ids, lab, valid = batch_seqs(items)
            outs = run_passes(model, hid, ids, valid)
            L = hid.shape[1]
            for d, f in enumerate(outs):
                tgt = torch.full_like(lab, IGNORE)
                tgt[:, : L - d - 2] = lab[:, d + 2:]
                m = tgt != IGNORE
                pred = tmap[model.logits(f[m]).argmax(-1)]
                right[d] += int((pred == tgt[m]).sum()); n[d] += int(m.sum())
    return [round(r / max(c, 1), 4) for r, c in zip(right, n)]


torch.manual_seed(0)
ARCH = os.environ.get('ARCH', 'draft')
draft = {'draft': Draft, 'head': lambda: HeadAttn(False), 'headattn': HeadAttn}[ARCH]()
print("at init", evaluate(draft), flush=True)
opt = torch.optim.AdamW(draft.parameters(), lr=LR, weight_decay=0.0)
BS = 4
steps = EPOCHS * math.ceil(len(train) / BS)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, LR, total_steps=steps, pct_start=0.05)
t0 = time.time()
order = sorted(range(len(train)), key=lambda j: len(train[j][1]))
s = 0
for ep in range(EPOCHS):
    chunks = [order[i:i + BS] for i in range(0, len(order), BS)]
    perm = torch.randperm(len(chunks)).tolist()
    for c in perm:
        loss, stats = losses(draft, [train[j] for j in chunks[c]])
        opt.zero_grad(); loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step(); sched.step(); s += 1
        if s % 50 == 0:
            print(s, steps, round(time.time() - t0), [(round(a, 3), round(b, 4)) for a, b in stats], flush=True)
    print("epoch", ep, evaluate(draft), round(time.time() - t0), flush=True)
