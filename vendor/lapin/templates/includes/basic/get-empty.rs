/// Server response to `basic.get` indicating the queue is empty.
