"""The aiohttp shell around the decision core: server side, upstream client, replay."""
