"""Writes translation pairs in the Hugging Face hub's parquet layout, as the `wmt/wmt14`
repository holds them: `<out>/<config>/<split>-0000k-of-0000n.parquet`, one column
`translation` of structs {<source lang>: text, <target lang>: text}. Used to build that layout
here from the offline corpus (no network):

    python -m transformer.data.hub_layout --dataset=offline_de_en --out=data/wmt14 --config=de-en

and then `--config.data.dataset=data/wmt14/de-en` (configs/wmt14_files.py).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

SPLITS = ("train", "validation", "test")


def write_split(pairs: list[tuple[str, str]], directory: str, split: str,
                languages: tuple[str, str], shards: int) -> list[str]:
    """`pairs` of (languages[0] text, languages[1] text) as `shards` parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    paths = []
    for k, part in enumerate(np.array_split(np.arange(len(pairs)), shards)):
        column = [{languages[0]: pairs[i][0], languages[1]: pairs[i][1]} for i in part]
        path = os.path.join(directory, f"{split}-{k:05d}-of-{shards:05d}.parquet")
        pq.write_table(pa.table({"translation": column}), path)
        paths.append(path)
    return paths


def from_tfds(dataset: str, out: str, config: str, *, data_dir: str | None = None,
              shards: int = 4) -> str:
    """A TFDS translation dataset's splits in the hub layout under `<out>/<config>`."""
    from transformer.data.datasets import open_split, prepare_dataset, read_pairs

    builder = prepare_dataset(dataset, data_dir)
    languages = tuple(sorted(builder.info.features.languages))
    directory = os.path.join(out, config)
    for split in SPLITS:
        if split in builder.info.splits:
            source = open_split(builder, split)
            pairs = read_pairs(source, range(len(source)), *languages)
            write_split(pairs, directory, split, languages,
                        shards if split == "train" else 1)
    return directory


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="offline_de_en")
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="de-en")
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args(argv)
    print(from_tfds(args.dataset, args.out, args.config, data_dir=args.data_dir,
                    shards=args.shards))


if __name__ == "__main__":
    main()
