"""`tandem synth`: random models with the real shapes of MoE models, to measure speed without real weights.

Only the presets are imported here (cheap); the writer lives in `tandem.synth.writer`.
"""

from tandem.synth.presets import PRESETS, BadLayersError, Preset, SynthError, UnknownPresetError, get_preset

__all__ = ["PRESETS", "BadLayersError", "Preset", "SynthError", "UnknownPresetError", "get_preset"]
