# loader.py ROOT MANIFEST LOADERS EPOCH_SEED CHECK [COPY_DIR] -> samples bytes seconds bad
# (bench/loader*.sh): LOADERS processes read the manifest's files whole in a shuffled order
# (seeded), in batches of 32; CHECK=1 checks each against its SHA-256. COPY_DIR: each
# sample is also written once to a new file there (what any cache that keeps a copy on the
# node's disk does at the least: the limit of a cold epoch that caches).
import hashlib, multiprocessing as mp, os, random, sys, time
root, manifest, n, seed, check = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
copy = sys.argv[6] if len(sys.argv) > 6 else None
want = dict(l.split() for l in open(manifest))
names = sorted(want)
random.Random(seed).shuffle(names)
def work(i, q):
    total, bad, count = 0, 0, 0
    mine = names[i::n]
    for b in range(0, len(mine), 32):
        for rel in mine[b:b + 32]:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
            if copy:
                fd = os.open(os.path.join(copy, rel.replace("/", "_")), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(fd, data)
                os.close(fd)
            total += len(data)
            count += 1
            if check and hashlib.sha256(data).hexdigest() != want[rel]:
                bad += 1
    q.put((count, total, bad))
q = mp.Queue()
t = time.monotonic()
ps = [mp.Process(target=work, args=(i, q)) for i in range(n)]
for p in ps: p.start()
res = [q.get() for _ in ps]
for p in ps: p.join()
took = time.monotonic() - t
print(sum(r[0] for r in res), sum(r[1] for r in res), f"{took:.3f}", sum(r[2] for r in res))
