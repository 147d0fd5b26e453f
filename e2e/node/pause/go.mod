module diloco-e2e.local/pause

go 1.26.0
