# make-samples.py ROOT FILES KIB MANIFEST: FILES sample files of ~KIB KiB (±15 %) in 20
# folders under ROOT, and a manifest of their paths and SHA-256s (bench/loader*.sh).
import hashlib, os, random, sys
root, n, kib, manifest = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(7)
blob = os.urandom(int(kib * 1024 * 1.2) + 65536)
per = max(1, n // 20)
with open(manifest, "w") as m:
    for i in range(n):
        d = os.path.join(root, f"d{i // per:03d}")
        os.makedirs(d, exist_ok=True)
        size = max(1, int(kib * 1024 * rng.uniform(0.85, 1.15)))
        off = rng.randrange(0, 65536)
        data = blob[off:off + size]
        rel = f"d{i // per:03d}/s{i:06d}.bin"
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        m.write(f"{rel} {hashlib.sha256(data).hexdigest()}\n")
