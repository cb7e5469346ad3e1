"""How much a recipe may ask of the front end, so that no file can make `check` hang,
exhaust memory or overflow Python's stack. A real recipe is < 30 lines; every bound
here is orders of magnitude above that and is reported as a located error.
docs/recipe-language.md ("Limits") lists them with the run-time ranges of the stages."""

MAX_FILE_BYTES = 1 << 20  # a recipe file (and each file it extends)
MAX_YAML_NODES = 10_000  # YAML values in one file, counting each alias at its expanded size
MAX_YAML_DEPTH = 64  # maps/lists nested in one another, through aliases too
MAX_CALL_NESTING = 16  # stage calls nested as arguments: residual(lloydmax(...)) is 2
MAX_PIPELINE_STAGES = 256  # stage calls in one pipeline text (each is lowered once per layer)
MAX_PIPELINE_CHARS = 1 << 14  # pipeline text in one file, all layer overrides together (parsing ~0.2 s, ~16 MiB)
MAX_SCHEDULE_CHARS = 1024  # linear(from=a, to=b) written as a parameter value
MAX_EXTENDS = 16  # recipes in one `extends` chain
