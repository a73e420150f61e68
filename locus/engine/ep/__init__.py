"""The expert-parallel runtime: experts spread over ranks as a placement says, tokens sent to them
and back with torch.distributed all-to-all, and one engine loop for every rank."""
