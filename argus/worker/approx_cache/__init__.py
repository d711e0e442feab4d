"""Approximate caching (NIRVANA): earlier prompts' intermediate latents kept in a latent store
(:mod:`.latent_store`), found by prompt similarity in a vector index (:mod:`.vector_index`),
resumed at step K by :mod:`.cache`; how one request uses it is :mod:`.use`."""
