"""Writes translation pairs in the Hugging Face hub's parquet layout, as the `wmt/wmt14`
repository holds them: `<out>/<config>/<split>-0000k-of-0000n.parquet`, one column
`translation` of structs {<source lang>: text, <target lang>: text}. Used to build that layout
here from the offline corpus (no network):

    python -m transformer.data.hub_layout --dataset=offline_de_en --out=data/wmt14 --config=de-en

and then `--config.data.dataset=data/wmt14/de-en` (configs/wmt14_files.py).
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags

SPLITS = ("train", "validation", "test")
FLAGS = flags.FLAGS


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


def define_flags() -> None:
    """The command line's flags: defined only when run as a command, not on import."""
    flags.DEFINE_string("dataset", "offline_de_en", "The TFDS translation dataset to write.")
    flags.DEFINE_string("out", None, "The directory to write the layout under.", required=True)
    flags.DEFINE_string("config", "de-en", "The hub config's name: the subdirectory of --out.")
    flags.DEFINE_string("data_dir", None, "TFDS data_dir (default: TFDS's).")
    flags.DEFINE_integer("shards", 4, "Parquet files of the train split.", lower_bound=1)


def main(argv: list[str]) -> None:
    from transformer.util import cli

    cli.start(argv)
    with cli.one_line_errors():
        print(from_tfds(FLAGS.dataset, FLAGS.out, FLAGS.config, data_dir=FLAGS.data_dir,
                        shards=FLAGS.shards))


if __name__ == "__main__":
    define_flags()
    app.run(main)
