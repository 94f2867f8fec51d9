/**
 * A straggler's row in the panel: a word for why, from the verdict's finding.
 */
import { stragglerWhy } from '../model';
import { IVerdict } from '../request';

function verdict(detail: string, ranks: number[] = [3]): IVerdict {
  return {
    summary: detail,
    findings: [{ kind: 'straggler', ranks, group: null, seq: null, detail, evidence: '' }],
    checked: [],
    coverage: {},
    healthy: false,
    now: 0
  };
}

describe('stragglerWhy', () => {
  it('names the category of the finding that names the rank', () => {
    expect(stragglerWhy(verdict('rank 3 is the straggler: forward takes 61 ms vs 0.4 ms'), 3)?.word).toBe('compute');
    expect(stragglerWhy(verdict('rank 3 is the straggler: waiting for data takes 96 ms'), 3)?.word).toBe('data');
    expect(stragglerWhy(verdict('rank 3 is the straggler: garbage collection takes 50 ms'), 3)?.word).toBe('GC');
    expect(
      stragglerWhy(verdict('rank 3 is the straggler: forward takes 818 ms vs 243 ms for the CPU time of the others'), 3)
        ?.word
    ).toBe('host');
    expect(stragglerWhy(verdict('rank 3 is the straggler: its main thread waits for a CPU 60 %'), 3)?.word).toBe(
      'host'
    );
    expect(stragglerWhy(verdict('rank 3 is the straggler: no measured phase explains it'), 3)?.word).toBe('slow');
  });

  it('is null for a rank no straggler finding names, or without a verdict', () => {
    expect(stragglerWhy(verdict('ranks 2-3 are the stragglers: ...', [2, 3]), 1)).toBeNull();
    expect(stragglerWhy(null, 0)).toBeNull();
  });
});
