"""The model builders: the random-weight presets (tinymodel) and real models converted
from a GGUF (gguf_model). Used by `lockstep make-model`, `lockstep up` and the tests;
no running service imports them to serve."""
