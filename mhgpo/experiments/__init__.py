"""The experiment harness behind `mhgpo reproduce`: the paper's claims as tables of rows, run over seeds.

A row is a row of the table of rows (`experiments/rows.yaml`, `mhgpo.config.rows`), run at a scale (the demo's by
default) for a time budget (`budget_minutes` on the process's CPU time) from a warm start shared by every row of a
seed that has the same one: `mhgpo train` with its final validation, then `mhgpo eval` of the trained run on other
data sets, nothing else. Its modules:

| module | what it holds |
|---|---|
| `claims` | the tables: each a claim of the paper, its rows, the row compared with, the paper's directions |
| `jobs` | one (row, seed) as a job: the warm start, the training run and its evaluations, an oracle |
| `results` | the result cache: one atomic JSON per (row, seed) with the settings it ran under; run folders |
| `runner` | what is still to run, and the processes that run it, several at a time |
| `stats` | mean ± std over seeds, paired differences and the verdict rule |
| `page` | the page (docs/reproduction.md) from the results, its prose in `page.md` |
| `summary` | the README's results table from the results (a test holds the README's equal to it) |

The harness writes only into its output folder, and there only what it made: a run is trained in a temporary folder
named after its process and renamed when finished, a folder in its place that it did not make is refused, never
removed, and a link anywhere in the folder is refused before anything is written.
"""
