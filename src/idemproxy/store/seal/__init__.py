"""Encryption at rest of stored responses (SPEC §11): the key ring, the codec, the store."""
