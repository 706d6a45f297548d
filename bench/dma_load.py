# Diagnostic: pinned<->device copies both ways on two streams for SECONDS; DUTY < 1 sleeps so
# that the copies run that fraction of the time. Prints the host-memory traffic it caused.
import sys, time, torch
seconds, duty = float(sys.argv[1]), float(sys.argv[2])
n = 64 << 20  # 256 MiB of fp32 per buffer
h1, h2 = torch.empty(n, pin_memory=True), torch.empty(n, pin_memory=True)
d1, d2 = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
k, busy, t0 = 0, 0.0, time.time()
while time.time() < t0 + seconds:
    a = time.time()
    with torch.cuda.stream(s1):
        d1.copy_(h1, non_blocking=True)
    with torch.cuda.stream(s2):
        h2.copy_(d2, non_blocking=True)
    torch.cuda.synchronize()
    took = time.time() - a
    busy += took
    k += 1
    if duty < 1:
        time.sleep(took * (1 / duty - 1))
wall = time.time() - t0
print(f"DMA load duty {duty}: {k * 4 * n / busy / 1e9:.1f} GB/s each way while copying, "
      f"{2 * k * 4 * n / wall / 1e9:.1f} GB/s of host memory on average", flush=True)
