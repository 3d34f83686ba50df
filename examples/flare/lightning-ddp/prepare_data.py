"""Writes a small CIFAR-10-format dataset (``cifar-10-batches-py``) where the example reads it.

FLARE's example downloads CIFAR-10; a site without network (or a test) gets a set in the
same format: 32x32 RGB images of 10 classes, each class a colour pattern plus noise, so
that a model learns it in one epoch. Put the real CIFAR-10 folder there instead and the
example trains on it unchanged.

    python prepare_data.py [--root /tmp/nvflare/data] [--train 2000] [--test 400]
"""

import argparse
import os
import pickle

import numpy as np

BATCHES = "cifar-10-batches-py"
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def images(n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    labels = rng.integers(0, 10, size=n)
    base = np.zeros((10, 3, 32, 32), dtype=np.float32)
    for c in range(10):
        base[c, c % 3] = 0.8
        base[c, :, (c * 3) : (c * 3) + 6, :] = 0.2 + 0.06 * c
    noise = rng.normal(0.0, 0.15, size=(n, 3, 32, 32))
    data = np.clip((base[labels] + noise) * 255, 0, 255).astype(np.uint8)
    return data.reshape(n, 3 * 32 * 32), labels.tolist()


def write(path: str, data: np.ndarray, labels: list[int]) -> None:
    with open(path, "wb") as f:
        pickle.dump({"data": data, "labels": labels}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/tmp/nvflare/data")
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--test", type=int, default=400)
    args = p.parse_args()
    folder = os.path.join(args.root, BATCHES)
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(7)
    per_batch = -(-args.train // 5)
    for i in range(5):
        data, labels = images(per_batch, rng)
        write(os.path.join(folder, f"data_batch_{i + 1}"), data, labels)
    data, labels = images(args.test, rng)
    write(os.path.join(folder, "test_batch"), data, labels)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": CLASSES}, f)
    print(f"wrote {5 * per_batch} training and {args.test} test images to {folder}")


if __name__ == "__main__":
    main()
