# Copyright (c) 2025, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""
PyTorch Lightning DDP client for multi-GPU federated learning.

FLARE's own example (NVFlare ``examples/advanced/multi-gpu/lightning/client.py``) with one
change, marked "rankexec copy": the data is read from a local CIFAR-10-format folder
without torchvision's download and md5 check (a site without network; run
``prepare_data.py``, or put the real CIFAR-10 there), at ``$CIFAR10_ROOT`` if set. As a
rank group (``use_rank_groups`` in ``job.py``) each rank is a process of Lightning's DDP:
Lightning finds torchrun's variables and spawns nothing.
"""

import os
import pickle

import torch
import torchvision
import torchvision.transforms as transforms
from model import LitNet
from pytorch_lightning import LightningDataModule, Trainer, seed_everything
from torch.utils.data import DataLoader, random_split

# (1) import nvflare lightning client API
import nvflare.client.lightning as flare

seed_everything(7)

DATASET_PATH = os.environ.get("CIFAR10_ROOT", "/tmp/nvflare/data")  # rankexec copy
BATCH_SIZE = 4

transform = transforms.Compose(
    [transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]
)


class CIFAR10(torchvision.datasets.CIFAR10):
    """rankexec copy: torchvision's CIFAR-10 reader over a local folder, files present
    taken as they are (no download, no md5 check)."""

    def _check_integrity(self) -> bool:
        files = [name for name, _ in self.train_list + self.test_list]
        return all(os.path.isfile(os.path.join(self.root, self.base_folder, f)) for f in files)

    def _load_meta(self) -> None:
        with open(os.path.join(self.root, self.base_folder, self.meta["filename"]), "rb") as f:
            self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}


class CIFAR10DataModule(LightningDataModule):
    """CIFAR-10 data module for Lightning."""

    def __init__(self, data_dir: str = DATASET_PATH, batch_size: int = BATCH_SIZE):
        super().__init__()
        self.data_dir = data_dir
        self.batch_size = batch_size

    def prepare_data(self):
        CIFAR10(root=self.data_dir, train=True, download=True, transform=transform)
        CIFAR10(root=self.data_dir, train=False, download=True, transform=transform)

    def setup(self, stage: str):
        if stage == "fit" or stage == "validate":
            cifar_full = CIFAR10(  # rankexec copy
                root=self.data_dir, train=True, download=False, transform=transform
            )
            self.cifar_train, self.cifar_val = random_split(cifar_full, [0.8, 0.2])

        if stage == "test" or stage == "predict":
            self.cifar_test = CIFAR10(  # rankexec copy
                root=self.data_dir, train=False, download=False, transform=transform
            )

    def train_dataloader(self):
        return DataLoader(self.cifar_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.cifar_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.cifar_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.cifar_test, batch_size=self.batch_size)


def main():
    model = LitNet()
    cifar10_dm = CIFAR10DataModule()

    # DDP trainer with 2 devices
    trainer = Trainer(
        max_epochs=1,
        strategy="ddp",
        devices=2,
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
    )
    print(f"DDP mode: global_rank={trainer.global_rank}")
    # (2) patch the lightning trainer
    flare.patch(trainer)

    while True:
        # Check if FLARE is running and broadcast to all ranks
        is_running = flare.is_running()
        is_running = trainer.strategy.broadcast(is_running, src=0)

        if not is_running:
            break

        # (3) receives FLModel from NVFlare
        # Note that we don't need to pass this input_model to trainer
        # because after flare.patch the trainer.fit/validate will get the
        # global model internally
        input_model = flare.receive()
        if input_model:
            print(f"\n[Round={input_model.current_round}, Site={flare.get_site_name()}]")

        # (4) evaluate the current global model to allow server-side model selection
        print("--- validate global model ---")
        trainer.validate(model, datamodule=cifar10_dm)

        # perform local training starting with the received global model
        print("--- train ---")
        trainer.fit(model, datamodule=cifar10_dm)

        # test local model
        print("--- test ---")
        trainer.test(ckpt_path="best", datamodule=cifar10_dm)

        # get predictions
        print("--- predict ---")
        trainer.predict(ckpt_path="best", datamodule=cifar10_dm)


if __name__ == "__main__":
    main()
