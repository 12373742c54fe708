"""The target model on the host: loading and describing it (and the `prepare_target` stage), its head, the
memory its weights take, its chat template. Every stage family reads the target through here."""
