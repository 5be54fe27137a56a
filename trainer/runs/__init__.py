"""Run logic above the engine: the SFT, GRPO and OPD loops and their `.kiln-checkpoint` directories."""
