"""Integrations with the frameworks that own the user's workers: ``ray_train`` (a Ray Train
worker group as one device mesh, weight syncs called by every rank). They import their framework
on use: ``import reshard.integrations.ray_train`` inside the train function."""
