"""Prefill/decode disaggregation shaped by CED (MODEL.md §9): `roles` (which tensors a prefill
or decode worker holds), `handover` (what one request moves from P to D, packed as the caches
store it), `transfer` (layer by layer over torch.distributed point-to-point), `workers`
(PrefillWorker, DecodeWorker)."""
