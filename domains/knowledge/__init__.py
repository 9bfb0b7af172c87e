"""Knowledge bases: upload files, parse, chunk, embed and index them into Milvus as durable tasks."""
