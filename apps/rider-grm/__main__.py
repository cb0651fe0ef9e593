"""rider-grm: VeRL-with-RMs on the shared trainer loop (`rider_recipe.py`): a text policy trained
on a rule reward, generative judges and an embedding-similarity reward; `uv run apps/rider-grm`
runs the embedded tiny CPU default, `uv run apps/rider-grm --resume` continues the latest run."""

from rider_config import ENTRY

ENTRY.attach(__name__)
