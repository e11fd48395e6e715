"""Print requirement lines from pyproject.toml, one a line, for `pip install -r`.

    python3 docker/requirements.py cpu            # the `cpu` extra
    python3 docker/requirements.py - model        # `-` is [project].dependencies, then the `model` extra

The images install dependencies from pyproject.toml before copying kvserve's source, so that editing the code does
not invalidate the multi-GB dependency layer; the same file stays the single list of what kvserve needs.
"""

import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
for group in sys.argv[1:]:
    print("\n".join(project["dependencies"] if group == "-" else project["optional-dependencies"][group]))
