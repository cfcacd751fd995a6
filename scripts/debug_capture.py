"""Debug helper: trace the stream/event ops one compiled decode step executes, then capture."""
import torch, v41graph
from v41graph.model import V41Model, init_random_
from v41graph.session import Session
from v41graph.custom_ops import streams as S

log = []
for name in ("stream_enter", "stream_exit", "event_record", "event_wait"):
    fn = getattr(S, name)
    orig = fn._init_fn if hasattr(fn, "_init_fn") else None
m = init_random_(V41Model(v41graph.V41Config.tiny()), seed=4).cuda().eval().requires_grad_(False)
c = v41graph.compile(m, backend="cuda", batch_sizes=(4,), capture=False)
s = Session(c, 3, 64, block_size=16)
lg = s.prefill(torch.randint(0, 256, (3, 12)))
rt = S.RUNTIME
orig_event, orig_stream = rt.event, rt.stream
def ev(tag):
    log.append(("event", tag, torch.cuda.current_stream().stream_id)); return orig_event(tag)
def st(tag):
    log.append(("stream", tag, torch.cuda.current_stream().stream_id)); return orig_stream(tag)
rt.event, rt.stream = ev, st
lg = s.decode(lg.argmax(-1, keepdim=True))
for e in log: print(*e)
print("stack", rt.stack)
gm = c.pass_manager
