"""Host-side cost per eager call of the public ops (GPU machine): wall time per call and a cProfile."""
import cProfile, pstats, time, torch, cupy_dsa
from cupy_dsa import layouts
dev = "cuda"
B, ctx = 1, 8192
cache = layouts.empty_cache(ctx // 64, "bf16", device=dev); cache.random_(0, 120)
q = torch.randn(B, 1, 64, 128, device=dev).to(torch.float8_e4m3fn)
w = torch.rand(B, 64, device=dev)
lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
bt = torch.arange(ctx // 64, dtype=torch.int32, device=dev)[None]
f = lambda: cupy_dsa.paged_mqa_logits(q, cache, w, lens, bt, ctx)
for _ in range(50): f()
torch.cuda.synchronize()
n = 2000; t = time.perf_counter()
for _ in range(n): f()
t1 = time.perf_counter(); torch.cuda.synchronize()
print(f"paged_mqa_logits host: {(t1 - t) / n * 1e6:.1f} us/call (enqueue), {(time.perf_counter() - t) / n * 1e6:.1f} us incl. sync")
kv = torch.randn(64, 128, device=dev); pos = torch.arange(64, device=dev); loc = torch.arange(64, device=dev)
fr = torch.randn(4096, 64, device=dev); nw = torch.ones(128, device=dev)
g = lambda: cupy_dsa.store_index_k(kv, cache, positions=pos, out_loc=loc, norm_weight=nw, freqs_cis=fr)
for _ in range(50): g()
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(n): g()
print(f"store_index_k host: {(time.perf_counter() - t) / n * 1e6:.1f} us/call")
pr = cProfile.Profile(); pr.enable()
for _ in range(500): f()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
