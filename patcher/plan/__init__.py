"""Select and plan: planning (select -> classify -> desired set -> states -> changes; standard
library only, the text a bundle embeds), selection (packaging's PEP 440 for it: which patches and
edits hold for the versions a target has) and target_plan (one target's plan, with the codemods
run here)."""
