"""On CUDA: remat.trace puts back the gradients and AdamW state (fused, as the bench's) it finds, and
leaves none behind on a fresh run; prints one JSON line. PYTHONPATH=src python benchmarks/trace_state_cuda.py"""

import json

import torch

import remat

torch.manual_seed(0)
model = remat.models.build("llama3_tiny", dtype=torch.bfloat16, device="cuda", num_layers=3, seq_length=64)
ids = torch.randint(0, model.config.vocab_size, (2, 65), device="cuda")
batch = ids[:, :-1], ids[:, 1:]
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
remat.trace(model, batch, optimizer=optimizer, timing_repeats=1)
fresh = dict(grads_left=sum(p.grad is not None for p in model.parameters()), states_left=len(optimizer.state))
model(*batch).backward()
optimizer.step()
grads = [p.grad.clone() for p in model.parameters()]
states = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
weights = [p.detach().clone() for p in model.parameters()]
remat.trace(model, batch, optimizer=optimizer, timing_repeats=1)
print(
    json.dumps(
        dict(
            fresh,
            weights_equal=all(torch.equal(w, p) for w, p in zip(weights, model.parameters())),
            grads_equal=all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters())),
            states_equal=all(
                torch.equal(v, optimizer.state[p][k]) and v.device == optimizer.state[p][k].device
                for s, p in zip(states, model.parameters())
                for k, v in s.items()
            ),
        )
    )
)
