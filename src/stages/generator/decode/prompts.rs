//! The stream's plain prompts as a row source: G completions of each, published as one
//! group once every row has finished.

use super::group::{FromReader, Groups, Queue, RowEnd};
use super::inbox::Inbox;
use super::source::{Panicked, RowSource, Rows, Waiting};
use crate::model::ModelError;
use crate::model::sampler::Completion;

pub struct PromptSource {
    queue: Queue,
    groups: Groups,
}

impl PromptSource {
    pub fn new(inbox: Inbox<FromReader>, groups: Groups) -> Self {
        PromptSource {
            queue: Queue::new(inbox),
            groups,
        }
    }
}

impl RowSource for PromptSource {
    fn receive(&mut self) {
        self.queue.receive();
    }

    fn waiting(&self) -> Waiting {
        self.queue.waiting()
    }

    fn busy(&self) -> bool {
        self.groups.busy()
    }

    fn admit(&mut self, rows: &mut Rows<'_>) -> Result<(), ModelError> {
        let admits = self.queue.all_that_fit(rows, self.groups.group_size());
        self.groups.start_all(rows, admits)
    }

    fn owns(&self, request: u64) -> bool {
        self.groups.owns(request)
    }

    fn label(&self, request: u64) -> Option<&str> {
        self.groups.label(request)
    }

    fn finished(&mut self, _rows: &mut Rows<'_>, c: Completion) {
        let (request, index) = (c.request_id, c.index);
        self.groups
            .settle(request, index, RowEnd::Done(Box::new(c)));
    }

    fn panicked(&mut self, request: u64, how: &Panicked<'_>) {
        self.groups.panicked(request, how);
    }

    fn closed(&self) -> bool {
        self.groups.closed()
    }
}
