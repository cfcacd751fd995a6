"""Debug helper (device): capture a toy fork/join with our stream ops, then one compiled
decode step of the tiny model, tracing every stream op with the stream it ran on."""
import torch
import v41graph
from v41graph.custom_ops import streams as S
from v41graph.model.model import V41Model, init_random_
from v41graph.runtime.session import Session

ops = torch.ops.v41graph
log = []
rt = S.RUNTIME
orig_event, orig_stream = rt.event, rt.stream
def ev(tag):
    log.append(("event", tag, torch.cuda.current_stream().stream_id, torch.cuda.is_current_stream_capturing()))
    return orig_event(tag)
def st(tag):
    log.append(("stream", tag, torch.cuda.current_stream().stream_id, torch.cuda.is_current_stream_capturing()))
    return orig_stream(tag)
rt.event, rt.stream = ev, st

x = torch.randn(1024, device="cuda")
def toy():
    ops.event_record("fork:t"); ops.stream_enter("aux:t"); ops.event_wait("fork:t")
    y = x * 2
    ops.event_record("join:t"); ops.stream_exit(); ops.event_wait("join:t")
    return y + 1
toy()
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g):
        out = toy()
    g.replay(); torch.cuda.synchronize(); print("toy capture OK", float(out[0]), float(x[0] * 2 + 1))
except Exception as e:
    print("toy capture FAILED", e)
print(log); log.clear()

m = init_random_(V41Model(v41graph.V41Config.tiny()), seed=4).cuda().eval().requires_grad_(False)
c = v41graph.compile(m, backend="cuda", batch_sizes=(4,))
s = Session(c, 3, 64, block_size=16)
lg = s.prefill(torch.randint(0, 256, (3, 12)))
log.clear()
try:
    lg = s.decode(lg.argmax(-1, keepdim=True))
    print("model capture OK")
except Exception as e:
    print("model capture FAILED", str(e)[:200])
cap = [e for e in log if e[3]]
print(len(log), "stream-op calls,", len(cap), "while capturing")
for e in cap[:60]:
    print(*e)
print("stack left:", rt.stack)
